import sys

from draft_worker.main import main

main(sys.argv[1:])
