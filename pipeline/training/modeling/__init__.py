"""The models the stages share: the target (``target``), the EAGLE-3 drafter (``drafter``), the
drafter's config as we train it and as servers load it (``drafter_config``), and which target
layers it reads in each engine's numbering (``layers``)."""
