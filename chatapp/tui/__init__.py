"""The Textual front end; `chatapp.tui.app.run_app` starts it. Reaches the engine only via ChatBackend."""
