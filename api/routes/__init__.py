"""One router per resource; each handler calls a service (api.chat, api.pooling, ...), and
no route imports another: what two endpoints share lives in a service. api.main includes
them."""
