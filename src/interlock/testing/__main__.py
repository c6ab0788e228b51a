"""``python -m interlock.testing``: serve the fake LLM (see :mod:`interlock.testing`)."""

from ._fake import main

main()
