"""An OpenAI-compatible server for a target and its DFlash 2 drafter, with continuous batching on DFlash 2's own loop:
`engine.py` (rows, queue, rounds) and `app.py` (FastAPI endpoints); `dflash2 serve` starts it."""
