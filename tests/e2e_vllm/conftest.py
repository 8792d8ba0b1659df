"""The end-to-end modules' shared fixtures, from the kit that holds them
(:mod:`vllm_e2e_kit`): a module asks for them by name and imports none."""

from __future__ import annotations

from vllm_e2e_kit import model, prompt_file  # noqa: F401  (the tiny Llama, the prompt)
