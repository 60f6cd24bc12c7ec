import sys

from shardfuse.cli import main

sys.exit(main())
