"""UniPrefill token drop, the runtime's side: the step transform (transform.py, registered on import
of that module), what one step's drops do (step.py) and what they leave per sequence
(drop_records.py)."""
