import sys

from target_worker.main import main

main(sys.argv[1:])
