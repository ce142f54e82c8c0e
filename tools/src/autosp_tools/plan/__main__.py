import sys

from autosp_tools.plan.cli import main

sys.exit(main())
