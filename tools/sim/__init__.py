"""The in-process simulator (`locoswarm sim`): many peers, one process, the node's own outer step."""
