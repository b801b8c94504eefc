"""Tools from MCP servers in the chat: configuration (`config`), the client on its own thread (`client`), and
the reply loop that runs approved calls and sends their results back to the model (`loop`)."""
