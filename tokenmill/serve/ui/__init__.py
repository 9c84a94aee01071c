"""The web console's static files (static/: plain HTML, ES modules and CSS, no build step), served by
serve/routes/ui.py."""
