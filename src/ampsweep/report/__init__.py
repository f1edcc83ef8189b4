"""The comparison report of a sweep: its data, the numbers against the baseline, findings in
words, tables, charts, and publishing it to the sweep's parent run. Imports no torch."""
