import sys

from slipstream.cli import main

sys.exit(main())
