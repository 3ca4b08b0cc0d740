package netfault

import (
	"bytes"
	"encoding/binary"
)

// PostgreSQL's protocol codes in the first message of a connection
// (protocol.sgml, "Message Formats").
const (
	pgSSLRequest    = 80877103
	pgGSSENCRequest = 80877104
	pgCancelRequest = 80877102
)

// PostgresStartup reads the StartupMessage a PostgreSQL client sent first
// (head is ConnInfo.Head): its parameters (user, database, application_name,
// replication, options, …) and whether head holds a whole one. An
// SSLRequest or GSSENCRequest before it is skipped: the server refused it
// when the StartupMessage follows in the clear. A connection that went on
// in TLS, or whose client sent a CancelRequest, has no StartupMessage to
// read.
func PostgresStartup(head []byte) (map[string]string, bool) {
	for {
		if len(head) < 8 {
			return nil, false
		}
		n := int(binary.BigEndian.Uint32(head))
		code := binary.BigEndian.Uint32(head[4:])
		switch {
		case n == 8 && (code == pgSSLRequest || code == pgGSSENCRequest):
			head = head[8:]
			continue
		case code == pgCancelRequest || code>>16 != 3: // protocol 3.x only
			return nil, false
		case n < 9 || len(head) < n:
			return nil, false
		}
		params := map[string]string{}
		body := head[8:n]
		for {
			name, rest, ok := bytes.Cut(body, []byte{0})
			if !ok || len(name) == 0 {
				return params, ok
			}
			value, rest, ok := bytes.Cut(rest, []byte{0})
			if !ok {
				return nil, false
			}
			params[string(name)] = string(value)
			body = rest
		}
	}
}

// PostgresParam returns a selector for BlackHoleConns that selects the
// PostgreSQL connections whose StartupMessage sets parameter name to value:
// PostgresParam("replication", "database") for a logical replication
// connection, PostgresParam("application_name", "…") for a client's named
// connection.
func PostgresParam(name, value string) func(ConnInfo) bool {
	return func(c ConnInfo) bool {
		params, ok := PostgresStartup(c.Head)
		return ok && params[name] == value
	}
}
