package admin

import (
	"context"
	"fmt"
	"slices"
	"strings"
)

// failoverVersion is the first server_version_num that syncs logical slots
// to physical standbys (PostgreSQL 17).
const failoverVersion = 170000

// physicalStandby is a physical replication slot, or a physical walsender
// without one, as the primary sees it.
type physicalStandby struct {
	slot     string // "" for a walsender without a slot
	active   bool
	feedback bool // the standby reports its xmin: hot_standby_feedback is on
	app      string
}

// failover reports what the primary can tell about a failover to a
// physical standby (docs/failover.md): whether there are standbys at all;
// on PostgreSQL 17+ whether the relay's slot has failover enabled, whether
// synchronized_standby_slots names the standbys' slots (otherwise the relay
// may deliver commits a standby never received), and whether each standby
// sends hot_standby_feedback (sync_replication_slots needs it). A standby's
// own settings (sync_replication_slots, primary_slot_name, a dbname in
// primary_conninfo) are out of the primary's sight: the fix lists them.
func (d *diagnosis) failover(ctx context.Context) {
	if !d.cfg.Replication || d.walLevelSetting != "logical" {
		return
	}
	// Physical slots, and physical walsenders (no database) without one.
	rows, err := d.conn.Query(ctx, catalogSQL("FailoverPhysicalStandbys"))
	if err != nil {
		d.add(Fail, "failover", fmt.Sprintf("read the physical standbys: %v", err), "")
		return
	}
	var standbys []physicalStandby
	for rows.Next() {
		var s physicalStandby
		if err := rows.Scan(&s.slot, &s.active, &s.feedback, &s.app); err != nil {
			rows.Close()
			d.add(Fail, "failover", fmt.Sprintf("read the physical standbys: %v", err), "")
			return
		}
		standbys = append(standbys, s)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		d.add(Fail, "failover", fmt.Sprintf("read the physical standbys: %v", err), "")
		return
	}
	if len(standbys) == 0 {
		d.add(OK, "failover", "no physical standby: nothing to fail over to (a managed service's own standby may not show here; see docs/failover.md)", "")
		return
	}
	var slotNames, described []string
	for _, s := range standbys {
		switch {
		case s.slot == "":
			described = append(described, fmt.Sprintf("walsender %q without a slot", s.app))
		case s.active:
			slotNames = append(slotNames, s.slot)
			described = append(described, fmt.Sprintf("slot %s (streaming)", s.slot))
		default:
			slotNames = append(slotNames, s.slot)
			described = append(described, fmt.Sprintf("slot %s (not streaming)", s.slot))
		}
	}
	summary := strings.Join(described, ", ")
	standbySettings := fmt.Sprintf("-- on each standby:\nALTER SYSTEM SET hot_standby_feedback = on;\nALTER SYSTEM SET sync_replication_slots = on;   -- 17+; also primary_slot_name, and dbname=%s in primary_conninfo\nSELECT pg_reload_conf();",
		d.dbName(ctx))

	if d.version < failoverVersion {
		d.add(OK, "failover", fmt.Sprintf("physical standbys: %s. Before PostgreSQL 17 no logical slot is kept on a standby: after a promotion the relay makes a new slot, "+
			"handing the rows pending then to the claim path; events the old primary sent the relay but not the standby may have been delivered and are missing on the new primary (docs/failover.md)", summary), "")
		return
	}
	d.add(OK, "failover", "physical standbys: "+summary, "")
	d.failoverSlot(ctx)
	d.synchronizedStandbySlots(ctx, standbys, slotNames, summary)

	var noFeedback []string
	for _, s := range standbys {
		if s.active && !s.feedback {
			name := s.slot
			if name == "" {
				name = s.app
			}
			noFeedback = append(noFeedback, name)
		}
	}
	if len(noFeedback) > 0 {
		d.add(Warn, "standby feedback", fmt.Sprintf("standby %s sends no hot_standby_feedback: the slot sync needs it (without it the primary may vacuum away catalog rows a synced slot still needs, and the relay then makes a new slot after a promotion)", strings.Join(noFeedback, ", ")),
			standbySettings)
	} else {
		d.add(OK, "standby feedback", "every streaming standby sends hot_standby_feedback; each standby also needs sync_replication_slots = on (17+), which the primary cannot see", "")
	}
}

// failoverSlot checks the relay's slot's failover property (17+).
func (d *diagnosis) failoverSlot(ctx context.Context) {
	var failover bool
	err := d.conn.QueryRow(ctx, catalogSQL("FailoverSlotEnabled"), d.cfg.Slot).Scan(&failover)
	switch {
	case err != nil:
		// No slot yet: run creates it with failover enabled.
		return
	case failover:
		d.add(OK, "failover slot", fmt.Sprintf("slot %s has failover enabled: standbys with sync_replication_slots keep a copy the relay continues from after a promotion", d.cfg.Slot), "")
	default:
		d.add(Warn, "failover slot", fmt.Sprintf("slot %s has failover disabled: standbys do not sync it, so after a promotion the relay makes a new slot and hands the rows pending then to the claim path", d.cfg.Slot),
			"restart the relay: as it starts it enables failover on its slot when no other process streams from it (ALTER_REPLICATION_SLOT "+d.cfg.Slot+" (FAILOVER true))")
	}
}

// synchronizedStandbySlots checks that the primary holds back logical
// walsenders until the standbys have the WAL (17+).
func (d *diagnosis) synchronizedStandbySlots(ctx context.Context, standbys []physicalStandby, slotNames []string, summary string) {
	var setting string
	if err := d.conn.QueryRow(ctx, catalogSQL("SynchronizedStandbySlots")).Scan(&setting); err != nil {
		d.add(Fail, "synchronized_standby_slots", fmt.Sprintf("read setting: %v", err), "")
		return
	}
	var named []string
	for _, n := range strings.Split(setting, ",") {
		if n = strings.Trim(strings.TrimSpace(n), `"`); n != "" {
			named = append(named, n)
		}
	}
	value := strings.Join(slotNames, ",")
	fix := SettingFix(d.provider, "synchronized_standby_slots", value, false)
	if len(slotNames) == 0 {
		value = "<the standbys' physical slots>"
		fix = "give each standby a physical slot (SELECT pg_create_physical_replication_slot('standby1'); primary_slot_name = 'standby1' on the standby), then:\n" +
			SettingFix(d.provider, "synchronized_standby_slots", value, false)
	}
	if len(named) == 0 {
		d.add(Warn, "synchronized_standby_slots", fmt.Sprintf("empty, with physical standbys (%s): the relay can receive and deliver commits no standby has yet; after a failover those events are missing on the new primary", summary), fix)
		return
	}
	var missing, idle []string
	for _, n := range named {
		i := slices.IndexFunc(standbys, func(s physicalStandby) bool { return s.slot == n })
		switch {
		case i < 0:
			missing = append(missing, n)
		case !standbys[i].active:
			idle = append(idle, n)
		}
	}
	switch {
	case len(missing) > 0:
		d.add(Fail, "synchronized_standby_slots", fmt.Sprintf("names %s, which is not a physical slot here: logical walsenders wait for it, so the relay receives nothing", strings.Join(missing, ", ")),
			SettingFix(d.provider, "synchronized_standby_slots", strings.Join(slices.DeleteFunc(slices.Clone(named), func(n string) bool { return slices.Contains(missing, n) }), ","), false))
	case len(idle) > 0:
		d.add(Warn, "synchronized_standby_slots", fmt.Sprintf("names %s, whose standby is not streaming: the relay receives nothing new until it is back (that is the setting's purpose; remove a standby that is gone for good)", strings.Join(idle, ", ")), fix)
	default:
		d.add(OK, "synchronized_standby_slots", fmt.Sprintf("%s: the relay receives only commits those standbys have, and acknowledges its write-back only once they have it", setting), "")
	}
}

// dbName returns the current database's name, for the standby's
// primary_conninfo.
func (d *diagnosis) dbName(ctx context.Context) string {
	var db string
	if err := d.conn.QueryRow(ctx, catalogSQL("CurrentDatabase")).Scan(&db); err != nil {
		return "<database>"
	}
	return db
}
