import sys

from specdec.tools.cli import serve_role

sys.exit(serve_role("coordinator", sys.argv[1:]))
