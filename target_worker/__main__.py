import sys

from specdec.tools.cli import serve_role

sys.exit(serve_role("target", sys.argv[1:]))
