"""The HTML pages of the runs (GET / and GET /runs/{run_id}): what they show (views.py), the
sparklines (sparkline.py), and the templates with their headers (render.py, templates/)."""

__all__: list[str] = []
