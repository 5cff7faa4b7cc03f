"""The ML stages, one room each in pipeline order, and what they share.

Stages (each room's ``stage``, or ``train.loop``, holds the function ``stages`` runs):

- ``prepare/``: generated conversations -> tokenized shards with loss masks (the target's chat
  template) and the draft vocabulary.
- ``extract/``: the target's hidden states for every sample, in transformers (``hf``) or
  through a vLLM server (``served``).
- ``train/``: the drafter on those features: loop, loss, distributed (DDP/FSDP), checkpoints.
- ``export/``: the trained drafter as SGLang and vLLM load it, and in speculators' format.
- ``eval/``: its acceptance length, offline or served by vLLM/SGLang.

A stage never imports another stage; they meet through what they share:

- ``artifacts``: the typed records on disk, the capture layout (which layers) among them.
- ``features/``: the feature shards extract writes and train reads, the bounded cache, and how a
  train follows an extract still running.
- ``modeling/``: the target, the EAGLE-3 drafter, its config, and each engine's layer numbering.
- ``tracking``: TensorBoard and wandb, for train's curves and eval's acceptance.
- ``context``: how a stage talks to the engine; ``stages``: the stages by name.

Importing this package loads no torch: each stage does when it runs.
"""
