"""``python -m webui [--listen] [--port N] [--share --auth USER:PASS] [--workspace DIR] …``"""

import sys

from webui.app import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
