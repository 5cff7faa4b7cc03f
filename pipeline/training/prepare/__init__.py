"""The prepare stage (``stage``): reading the generated data (``inputs``), rendering it with the
target's chat template into loss-masked samples (``chat_template``), the draft vocabulary
(``vocab``)."""
