import sys

from tailserve.cli import main

sys.exit(main())
