package relay

// The longest keys the ledger records (docs/schema.md, "Key lengths"). The
// ledger's primary key (event_key, action) is a btree index, and PostgreSQL
// refuses an index entry over 2,704 bytes (8 kB pages, btree version 4) with
// SQLSTATE 54000: a key that long cannot have its delivery recorded. An
// entry holds the tuple's header (8 bytes), both keys with their length
// headers (4 bytes each) and alignment; a key longer than about 500 bytes
// may be stored compressed, so whether one fits would depend on its
// content. The bounds are on bytes whatever the content, with room to
// spare: an incompressible key of MaxEventKeyBytes beside a sink name of
// MaxSinkNameBytes makes an entry of 2,192 bytes.
const (
	// MaxEventKeyBytes is the longest event_key, in bytes, the relay
	// delivers; a longer one is dead-lettered before it is sent.
	MaxEventKeyBytes = 2048
	// MaxSinkNameBytes is the longest sink name (the ledger's action), in
	// bytes.
	MaxSinkNameBytes = 128
)
