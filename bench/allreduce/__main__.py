import sys

from bench.allreduce import main

sys.exit(main())
