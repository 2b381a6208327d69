"""Comparing finished runs (`python -m experiments.review RUN_OR_FOLDER ...`):

    runs.py   find and read run directories, rank them, the tables (text, markdown, csv)
    plots.py  the figures: metric against tokens/s and its Pareto front, recall by width, loss by position
"""
