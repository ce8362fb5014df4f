import sys

from rlfactory.cli import main

sys.exit(main())
