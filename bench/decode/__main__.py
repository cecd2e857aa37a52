import sys

from bench.decode import main

sys.exit(main())
