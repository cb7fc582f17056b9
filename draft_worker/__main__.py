import sys

from specdec.tools.cli import serve_role

sys.exit(serve_role("draft", sys.argv[1:]))
