import sys

from coordinator.main import main

main(sys.argv[1:])
