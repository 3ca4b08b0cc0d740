package nats

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Deployment identifies the outbox a sink publishes from among every relay
// that may publish into the same stream (docs/sinks.md, "Message ids").
// Event keys are unique per outbox only, and JetStream deduplicates per
// stream: under the bare key, the second deployment's "order-1-created"
// would be dropped as a duplicate of the first's and acknowledged.
type Deployment struct {
	// ID scopes the message ids: 1 to 64 ASCII letters, digits, '-' or '_',
	// and not "b64" (an id it scopes never looks like another
	// deployment's, nor like a key HeaderValue encoded). Every relay of one
	// deployment must use the same: DeploymentID derives it from the
	// database.
	ID string
	// ScopedFrom is the first outbox id whose message id carries ID. A
	// version before the scoping published every event under its bare key;
	// the events that existed when it was upgraded keep that id, so a
	// re-send of one after the upgrade is still dropped as a duplicate
	// within the stream's window. 0 scopes every event.
	ScopedFrom int64
}

// MaxDeploymentID is the longest Deployment.ID.
const MaxDeploymentID = 64

// DeploymentID derives a deployment's ID from what identifies its outbox:
// the database cluster's system identifier (pg_control_system(), which a
// promoted physical standby keeps), the database's name and the
// schema-qualified outbox table. It is the first 16 hex digits of their
// SHA-256.
func DeploymentID(systemIdentifier, database, outbox string) string {
	sum := sha256.Sum256([]byte(systemIdentifier + "\x00" + database + "\x00" + outbox))
	return hex.EncodeToString(sum[:8])
}

// Validate returns an error naming what is wrong with dep, or nil.
func (dep Deployment) Validate() error {
	switch {
	case dep.ID == "":
		return errors.New("the deployment id is empty")
	case len(dep.ID) > MaxDeploymentID:
		return fmt.Errorf("the deployment id %q is longer than %d characters", dep.ID, MaxDeploymentID)
	case dep.ID+":" == EncodedPrefix:
		return fmt.Errorf("the deployment id %q is reserved (encoded keys start with %q)", dep.ID, EncodedPrefix)
	case strings.Trim(dep.ID, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_") != "":
		return fmt.Errorf("the deployment id %q may hold only ASCII letters, digits, '-' and '_'", dep.ID)
	case dep.ScopedFrom < 0:
		return fmt.Errorf("the first scoped outbox id %d is negative", dep.ScopedFrom)
	}
	return nil
}

// MsgID returns the Nats-Msg-Id of a delivery: "<ID>:<key>", the event key
// as HeaderValue sends it, or for the n-th operator replay
// "<ID>:<key>~r<n>", so JetStream stores a replay instead of dropping it as
// a duplicate. An event below ScopedFrom gets the same without "<ID>:", as
// the version before the scoping sent it. A key that itself ends in "~r"
// and digits is encoded like an unsafe HeaderValue, so that no event's id
// is another event's replay id ("a~r1" is event "a"'s first replay); so is
// an unscoped key that starts like a scoped id ("<ID>:a"). Distinct
// Within a deployment distinct (key, replay) pairs always get distinct ids,
// and across deployments so do scoped ones; one delivery gets the same id on
// every attempt, on both paths and from every relay of the deployment.
func (dep Deployment) MsgID(d *relay.Delivery) string {
	scoped := d.Event.ID >= dep.ScopedFrom
	id := HeaderValue(d.Event.EventKey)
	if hasReplaySuffix(id) || !scoped && strings.HasPrefix(id, dep.ID+":") {
		id = EncodedPrefix + base64.RawURLEncoding.EncodeToString([]byte(d.Event.EventKey))
	}
	if scoped {
		id = dep.ID + ":" + id
	}
	if d.Replay > 0 {
		id += "~r" + strconv.Itoa(d.Replay)
	}
	return id
}

// hasReplaySuffix reports whether id ends like a replay's id: "~r" and one
// or more digits.
func hasReplaySuffix(id string) bool {
	i := strings.LastIndex(id, "~r")
	return i >= 0 && i+2 < len(id) && strings.Trim(id[i+2:], "0123456789") == ""
}
