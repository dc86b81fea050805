"""The offline engine: `LLM` runs the scheduler and one worker in this process."""
