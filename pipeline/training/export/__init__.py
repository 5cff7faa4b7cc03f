"""The export stage (``stage``): the drafter as SGLang and vLLM load it, and in
vllm-project/speculators' format (``speculators``)."""
