"""What stands in front of every route: the Host, Origin and content-type
checks against web pages (`browser.py`), the API key (`auth.py`), the
connection cap and header timeout (`connections.py`), request bodies'
size, time and JSON bounds (`body.py`), and draining (`draining.py`)."""
