"""What reads a run from outside it: the run view (run folders, the health warnings) and the chat page's parts
without Gradio (docs/watching.md)."""
