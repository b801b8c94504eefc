"""The app's widgets and screens, one concern per module."""
