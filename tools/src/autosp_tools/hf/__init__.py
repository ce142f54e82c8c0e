"""Hugging Face ``transformers.Trainer`` with AutoSP: ``AutoSPTrainer`` is a drop-in ``Trainer``.

```python
from autosp_tools.hf import AutoSPTrainer
trainer = AutoSPTrainer(model=model, args=training_args, train_dataset=ds, sp_size=2)
trainer.train()
```
"""

from autosp_tools.hf.data import UnsupportedLoader, shard_over_dp
from autosp_tools.hf.trainer import AutoSPSettings, AutoSPTrainer

__all__ = ["AutoSPSettings", "AutoSPTrainer", "UnsupportedLoader", "shard_over_dp"]
