"""The server's routes, grouped by surface; serve/app.py adds them to the app."""
