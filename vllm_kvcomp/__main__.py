import sys

from vllm_kvcomp.cli import main

sys.exit(main())
