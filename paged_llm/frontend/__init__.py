"""The front end: request intake, chat rendering, result streams and the engine clients."""
