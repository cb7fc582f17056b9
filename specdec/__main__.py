import sys

from specdec.tools.cli import main

sys.exit(main())
