import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_taco.training.resilience.exit import tie_at_start

# Before torch and DeepSpeed are imported: a rank whose launcher is gone ends now.
tie_at_start("pretrain_taco.py")
from megatron_taco.cli.pretrain_taco import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
