"""The extract stage (``stage``): the target in transformers (``hf``) or in a vLLM server
(``served``), both keeping the features index alike (``index``)."""
