"""The Textual front end; `chatapp.tui.launch.run_app` starts it. Reaches the engine only via ChatBackend."""
