import sys

from dsacache.cli.main import main

sys.exit(main())
