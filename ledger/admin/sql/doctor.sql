-- doctor's checks of the server, the role, the schema and the timeouts
-- (docs/operations.md). Every statement only reads.

-- name: DoctorServer
SELECT current_user, current_database(), current_setting('server_version'),
       current_setting('server_version_num')::int, pg_is_in_recovery();

-- name: DoctorWALLevel
SELECT current_setting('wal_level'), current_setting('max_replication_slots')::int,
       current_setting('max_wal_senders')::int;

-- name: DoctorRole
-- The role's attributes, and whether it is a member of rds_replication.
SELECT rolname, rolsuper, rolreplication, rolcreaterole, rolcreatedb, rolbypassrls,
       coalesce((SELECT pg_has_role(current_user, g.oid, 'MEMBER') FROM pg_roles g WHERE g.rolname = 'rds_replication'), false)
  FROM pg_roles WHERE rolname = current_user;

-- name: DoctorTriggerExists
-- Whether table $1 (a quoted name) has the trigger named $2.
SELECT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = to_regclass($1) AND tgname = $2);

-- name: DoctorTableExists
-- Whether table $1 (a quoted name) exists and this role can see its
-- schema.
SELECT to_regclass($1) IS NOT NULL;

-- name: DoctorSchemaVersion
SELECT version FROM {{.Versions}};

-- name: DoctorHasReplaysColumn
-- Whether table $1 (a quoted name) has the replays column (migration 006),
-- for a role that cannot read the version table.
SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1)
               AND attname = 'replays' AND NOT attisdropped);

-- name: DoctorDurationSetting
-- A time setting $1 of this session and its unit; no row when the server
-- does not have it.
SELECT setting::bigint, coalesce(unit, '') FROM pg_settings WHERE name = $1;

-- name: DoctorKeepalives
-- Whether this connection is TCP, and the server's TCP keepalives on it.
SELECT inet_server_addr() IS NOT NULL,
       current_setting('tcp_keepalives_idle')::bigint, current_setting('tcp_keepalives_interval')::bigint,
       current_setting('tcp_keepalives_count')::bigint, coalesce((SELECT setting::bigint FROM pg_settings WHERE name = 'tcp_user_timeout'), 0);
