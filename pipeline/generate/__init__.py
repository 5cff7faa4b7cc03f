"""The generate stage's parts: prompt sources, the OpenAI-compatible client, the crash-safe store.

HTTP and files only: nothing here imports torch.
"""
