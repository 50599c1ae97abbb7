import sys

from ddprun.cli import main

sys.exit(main())
