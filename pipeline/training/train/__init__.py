"""The train stage (``loop``): the TTT objective (``loss``), batches (``data``), one or many
processes (``distributed``), resumable checkpoints (``checkpoints``)."""
