"""The eval stage (``stage``): acceptance by speculative decoding in transformers (``offline``) or
by a vLLM/SGLang server with the drafter (``served``), one formula for both (``acceptance``)."""
