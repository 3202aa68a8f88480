"""Data sets: local files and folders (records.py), the built-in task (word_problems.py), data sets read with
`datasets` from the hub or save_to_disk folders (hub_data.py)."""
