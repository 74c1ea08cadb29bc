import sys

from mxfs.cli import main

sys.exit(main())
