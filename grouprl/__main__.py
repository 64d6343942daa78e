import sys

from grouprl.cli import main

sys.exit(main())
