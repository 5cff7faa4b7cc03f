"""The ML stages (prepare, extract, train, export, eval) and what they share: the target model,
the drafter, typed artifacts. A stage module never imports another stage module; they meet
through ``artifacts``, ``target``, ``features`` and ``drafter``. Importing this package loads
no torch: each stage does when it runs.
"""
