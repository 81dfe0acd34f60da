package dev.kvwire.interop;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ArrayNode;
import com.fasterxml.jackson.databind.node.JsonNodeFactory;
import com.fasterxml.jackson.databind.node.ObjectNode;
import java.io.IOException;
import java.io.PrintStream;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collection;
import java.util.Comparator;
import java.util.HashMap;
import java.util.HexFormat;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import java.util.stream.Stream;
import org.apache.avro.Schema;
import org.apache.avro.SchemaNormalization;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericDatumReader;
import org.apache.avro.generic.GenericEnumSymbol;
import org.apache.avro.generic.GenericFixed;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.io.BinaryDecoder;
import org.apache.avro.io.DecoderFactory;
import org.apache.avro.message.BinaryMessageDecoder;
import org.apache.avro.message.SchemaStore;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.PartitionInfo;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;

/**
 * Reads a kvwire topic the way a non-Python team would: official Kafka client, official Avro
 * single-object decoder, schemas taken from .avsc files and nothing from kvwire's code.
 *
 * <pre>
 * fingerprints SCHEMA_DIR
 *     one JSON line per .avsc: file, CRC-64-AVRO fingerprint (hex of the Java long), header bytes
 * consume BOOTSTRAP TOPIC SCHEMA_DIR COUNT TIMEOUT_MS
 *     one JSON line per record until COUNT records or TIMEOUT_MS; exit 2 when short of COUNT
 * consume-confluent BOOTSTRAP TOPIC SCHEMA_DIR REGISTRY_URL COUNT TIMEOUT_MS
 *     the same, reading Confluent-framed records too (00 + 4-byte big-endian schema id + body):
 *     the writer schema comes from the registry's Confluent API (GET /schemas/ids/ID), and
 *     Apache Avro resolves it to the newest shipped version. (Apicurio's own serdes would do the
 *     lookup for us, but they do not resolve from Maven Central alone: 3.0.9's parent pom is not
 *     served there, and 3.0.7's dependencies need a repository outside it.)
 * </pre>
 *
 * <p>JSON shape: bytes as lowercase hex; a union with more than one non-null branch is tagged
 * {"branch": value} as Avro's JSON encoding does, so bytes and strings in extra keys stay apart;
 * optional ["null", X] unions are written as the bare value.
 */
public final class ConsumeAndDecode {
  private static final ObjectMapper JSON = new ObjectMapper();
  private static final JsonNodeFactory NODES = JsonNodeFactory.instance;
  private static final HexFormat HEX = HexFormat.of();
  private static final Pattern VERSIONED = Pattern.compile("event_batch\\.v(\\d+)\\.avsc");

  private record Loaded(int version, Path file, Schema schema) {}

  public static void main(String[] args) throws Exception {
    if (args.length == 2 && args[0].equals("fingerprints")) {
      printFingerprints(loadSchemas(Path.of(args[1])), System.out);
      return;
    }
    if (args.length == 6 && args[0].equals("consume")) {
      int got = consume(args[1], args[2], loadSchemas(Path.of(args[3])), null,
          Integer.parseInt(args[4]), Long.parseLong(args[5]), System.out);
      System.exit(got >= Integer.parseInt(args[4]) ? 0 : 2);
    }
    if (args.length == 7 && args[0].equals("consume-confluent")) {
      int got = consume(args[1], args[2], loadSchemas(Path.of(args[3])), new RegistryIds(args[4]),
          Integer.parseInt(args[5]), Long.parseLong(args[6]), System.out);
      System.exit(got >= Integer.parseInt(args[5]) ? 0 : 2);
    }
    System.err.println("usage: fingerprints SCHEMA_DIR | consume BOOTSTRAP TOPIC SCHEMA_DIR COUNT TIMEOUT_MS"
        + " | consume-confluent BOOTSTRAP TOPIC SCHEMA_DIR REGISTRY_URL COUNT TIMEOUT_MS");
    System.exit(64);
  }

  /** Every version in the directory, oldest first: the newest one becomes the reader. */
  static List<Loaded> loadSchemas(Path dir) throws IOException {
    List<Loaded> out = new ArrayList<>();
    try (Stream<Path> files = Files.list(dir)) {
      for (Path f : (Iterable<Path>) files::iterator) {
        Matcher m = VERSIONED.matcher(f.getFileName().toString());
        if (!m.matches()) {
          continue;
        }
        // One parser per file: every version defines the same names, which one parser rejects.
        out.add(new Loaded(Integer.parseInt(m.group(1)), f, new Schema.Parser().parse(f.toFile())));
      }
    }
    if (out.isEmpty()) {
      throw new IOException("no event_batch.vN.avsc in " + dir);
    }
    out.sort(Comparator.comparingInt(Loaded::version));
    return out;
  }

  static void printFingerprints(List<Loaded> schemas, PrintStream out) throws IOException {
    for (Loaded l : schemas) {
      long fp = SchemaNormalization.parsingFingerprint64(l.schema());
      byte[] header = ByteBuffer.allocate(10).order(ByteOrder.LITTLE_ENDIAN)
          .put((byte) 0xC3).put((byte) 0x01).putLong(fp).array();
      ObjectNode o = NODES.objectNode();
      o.put("version", l.version());
      o.put("file", l.file().getFileName().toString());
      o.put("fingerprint", String.format("%016x", fp));
      o.put("header_hex", HEX.formatHex(header));
      out.println(JSON.writeValueAsString(o));
    }
  }

  /** Schema-registry id to writer schema, each id fetched once (Confluent REST API). */
  static final class RegistryIds {
    private final String url;
    private final HttpClient http = HttpClient.newHttpClient();
    private final Map<Integer, Schema> cache = new HashMap<>();

    RegistryIds(String url) {
      this.url = url.endsWith("/") ? url.substring(0, url.length() - 1) : url;
    }

    Schema get(int id) throws IOException, InterruptedException {
      Schema s = cache.get(id);
      if (s == null) {
        HttpResponse<String> r = http.send(
            HttpRequest.newBuilder(URI.create(url + "/schemas/ids/" + id)).GET().build(),
            HttpResponse.BodyHandlers.ofString());
        if (r.statusCode() != 200) {
          throw new IOException("schema id " + id + ": registry answered " + r.statusCode());
        }
        s = new Schema.Parser().parse(JSON.readTree(r.body()).get("schema").asText());
        cache.put(id, s);
      }
      return s;
    }
  }

  static int consume(String bootstrap, String topic, List<Loaded> schemas, RegistryIds registry,
      int count, long timeoutMs, PrintStream out) throws IOException {
    SchemaStore.Cache store = new SchemaStore.Cache();
    for (Loaded l : schemas) {
      store.addSchema(l.schema());
    }
    Schema reader = schemas.get(schemas.size() - 1).schema();
    BinaryMessageDecoder<GenericRecord> decoder =
        new BinaryMessageDecoder<>(GenericData.get(), reader, store);

    Properties props = new Properties();
    props.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
    props.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class.getName());
    props.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class.getName());
    props.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");
    props.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest");
    int got = 0;
    long deadline = System.currentTimeMillis() + timeoutMs;
    try (KafkaConsumer<byte[], byte[]> consumer = new KafkaConsumer<>(props)) {
      // No group: assign every partition so the read is a plain scan, as an index rebuild does.
      List<TopicPartition> tps = new ArrayList<>();
      for (PartitionInfo p : consumer.partitionsFor(topic, Duration.ofMillis(timeoutMs))) {
        tps.add(new TopicPartition(topic, p.partition()));
      }
      consumer.assign(tps);
      consumer.seekToBeginning(tps);
      while (got < count && System.currentTimeMillis() < deadline) {
        for (ConsumerRecord<byte[], byte[]> rec : consumer.poll(Duration.ofMillis(200))) {
          out.println(JSON.writeValueAsString(describe(rec, decoder, reader, registry)));
          got++;
        }
      }
    }
    out.flush();
    return got;
  }

  static ObjectNode describe(ConsumerRecord<byte[], byte[]> rec,
      BinaryMessageDecoder<GenericRecord> decoder, Schema reader, RegistryIds registry) {
    ObjectNode o = NODES.objectNode();
    o.put("partition", rec.partition());
    o.put("offset", rec.offset());
    o.put("key", rec.key() == null ? null : new String(rec.key(), StandardCharsets.UTF_8));
    ArrayNode headers = o.putArray("headers");
    for (Header h : rec.headers()) {
      headers.addArray().add(h.key())
          .add(h.value() == null ? null : new String(h.value(), StandardCharsets.UTF_8));
    }
    byte[] v = rec.value();
    try {
      if (registry != null && v != null && v.length >= 5 && v[0] == 0) {
        int id = ByteBuffer.wrap(v, 1, 4).getInt();  // big-endian, as Confluent frames it
        o.put("framing", "confluent");
        o.put("schema_id", id);
        Schema writer = registry.get(id);
        o.put("writer_fingerprint",
            String.format("%016x", SchemaNormalization.parsingFingerprint64(writer)));
        BinaryDecoder body = DecoderFactory.get().binaryDecoder(v, 5, v.length - 5, null);
        GenericRecord r = new GenericDatumReader<GenericRecord>(writer, reader).read(null, body);
        if (!body.isEnd()) {
          throw new IOException("trailing bytes after the record");
        }
        o.set("record", toJson(r, null));
        return o;
      }
      o.put("framing", "single-object");
      if (v != null && v.length >= 10) {
        // Which writer schema the record names: lets the test prove old versions were resolved.
        long fp = ByteBuffer.wrap(v, 2, 8).order(ByteOrder.LITTLE_ENDIAN).getLong();
        o.put("writer_fingerprint", String.format("%016x", fp));
      }
      o.set("record", toJson(decoder.decode(v), null));
    } catch (Exception e) {
      o.put("error", e.getClass().getSimpleName() + ": " + e.getMessage());
    }
    return o;
  }

  static JsonNode toJson(Object value, Schema schema) {
    if (value == null) {
      return NODES.nullNode();
    }
    if (schema != null && schema.getType() == Schema.Type.UNION) {
      List<Schema> branches = schema.getTypes();
      Schema branch = branches.get(GenericData.get().resolveUnion(schema, value));
      JsonNode inner = toJson(value, branch);
      long nonNull = branches.stream().filter(b -> b.getType() != Schema.Type.NULL).count();
      if (nonNull == 1) {
        return inner;
      }
      ObjectNode tagged = NODES.objectNode();
      tagged.set(branch.getFullName(), inner);
      return tagged;
    }
    if (value instanceof GenericRecord r) {
      ObjectNode o = NODES.objectNode();
      for (Schema.Field f : r.getSchema().getFields()) {
        o.set(f.name(), toJson(r.get(f.pos()), f.schema()));
      }
      return o;
    }
    if (value instanceof Collection<?> c) {
      Schema items = schema == null ? null : schema.getElementType();
      ArrayNode a = NODES.arrayNode();
      for (Object item : c) {
        a.add(toJson(item, items));
      }
      return a;
    }
    if (value instanceof Map<?, ?> m) {
      Schema values = schema == null ? null : schema.getValueType();
      ObjectNode o = NODES.objectNode();
      m.forEach((k, x) -> o.set(k.toString(), toJson(x, values)));
      return o;
    }
    if (value instanceof ByteBuffer b) {
      ByteBuffer d = b.duplicate();
      byte[] bytes = new byte[d.remaining()];
      d.get(bytes);
      return NODES.textNode(HEX.formatHex(bytes));
    }
    if (value instanceof GenericFixed f) {
      return NODES.textNode(HEX.formatHex(f.bytes()));
    }
    if (value instanceof GenericEnumSymbol<?> || value instanceof CharSequence) {
      return NODES.textNode(value.toString());
    }
    if (value instanceof Boolean b) {
      return NODES.booleanNode(b);
    }
    if (value instanceof Integer i) {
      return NODES.numberNode(i);
    }
    if (value instanceof Long l) {
      return NODES.numberNode(l);
    }
    if (value instanceof Float x) {
      return NODES.numberNode(x);
    }
    if (value instanceof Double x) {
      return NODES.numberNode(x);
    }
    throw new IllegalArgumentException("unexpected Avro value " + value.getClass());
  }
}
